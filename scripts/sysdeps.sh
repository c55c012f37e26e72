#!/usr/bin/env bash
# Installs the system packages the tests and the demo use, when missing.
# Only acts as root on Debian/Ubuntu; otherwise says what is missing and goes on
# (tests that need a missing server are skipped with that reason).
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v prometheus >/dev/null || need+=(prometheus)
if ! command -v cloud-pubsub-emulator >/dev/null \
  && ! dpkg -L google-cloud-cli-pubsub-emulator >/dev/null 2>&1; then
  need+=(google-cloud-cli-pubsub-emulator)
fi
command -v java >/dev/null || need+=(default-jre-headless)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # The emulator package lives in Google's apt repo; skip it quietly when apt cannot see it.
  for p in "${need[@]}"; do
    apt-get install -y -qq --no-install-recommends "$p" >/dev/null || echo "could not install $p"
  done
else
  echo "missing system packages (install them to run every test): ${need[*]}" >&2
fi

#!/usr/bin/env bash
# `make image`: builds the Dockerfile with podman on a machine that reaches Debian's package
# mirror and the Python package index, but no container registry.
#
#   1. base:  a Debian bookworm minbase with python3 + venv (mmdebstrap), `podman import`ed
#             and passed as --build-arg PYTHON_IMAGE (the Dockerfile's default stays the
#             pinned public python:3.11-slim-bookworm for builds that reach a registry);
#   2. wheels: requirements-image.txt's files (hash-checked) and the build backend, fetched
#             on the host, because the build container has neither the host's pip settings
#             nor its CA certificates; mounted into the build with a pip.conf that names
#             this folder as the only index;
#   3. build: podman build, with the OCI labels' version, revision and creation time.
#
# Podman runs with the runc runtime, cgroupfs and no default ulimits (crun refuses hybrid
# cgroups; raising ulimits is not permitted in an unprivileged machine): that config lives
# here, in CONTAINERS_CONF, not in the machine's /etc.
#
# Cached, and safe to reuse: the base by its package list and the ISO week (so it picks up
# Debian's security updates weekly), the wheelhouse by requirements-image.txt's hash (its
# files are hash-checked anyway), the layers by podman. IMAGE names the result.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-localhost/async-processor:dev}
PYTHON=${PYTHON:-python3}  # with pip: `make image` passes the project's .venv
SUITE=bookworm
PACKAGES=python3,python3-venv,python-is-python3
BACKEND=("setuptools>=68" "wheel")  # pyproject.toml's [build-system] requires
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/async-processor-image
mkdir -p "$CACHE"

CONTAINERS_CONF=$CACHE/containers.conf
cat > "$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF

need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "missing: ${need[*]} (install them, or run as root on Debian)" >&2
    exit 1
  fi
fi

key() { sha256sum | cut -c1-12; }

base_key=$(echo "$SUITE $PACKAGES $(date -u +%G-%V)" | key)
BASE=localhost/async-processor-base:$SUITE-$base_key
if ! podman image exists "$BASE"; then
  echo "base: mmdebstrap $SUITE minbase + $PACKAGES -> $BASE"
  SECONDS=0
  mmdebstrap --quiet --variant=minbase --include="$PACKAGES" --format=tar "$SUITE" - \
    | podman import --quiet - "$BASE" >/dev/null
  echo "base: ${SECONDS} s"
fi

wheels=$CACHE/wheels-$({ cat requirements-image.txt; echo "${BACKEND[*]}"; } | key)
if [ ! -d "$wheels" ]; then
  echo "wheels: requirements-image.txt + ${BACKEND[*]} -> $wheels"
  rm -rf "$wheels.tmp"
  SECONDS=0
  pip=("$PYTHON" -m pip download -qq --only-binary=:all: --dest "$wheels.tmp")
  # Markers are dropped: the host's Python is not the image's (async-timeout is for 3.11.2).
  sed 's/ ;[^\\]*\\$/ \\/' requirements-image.txt > "$CACHE/all-requirements.txt"
  "${pip[@]}" --no-deps --require-hashes -r "$CACHE/all-requirements.txt"
  "${pip[@]}" "${BACKEND[@]}"
  mv "$wheels.tmp" "$wheels"
  echo "wheels: ${SECONDS} s"
fi
printf '[global]\nno-index = true\nfind-links = /wheels\n' > "$CACHE/pip.conf"

revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || revision="$revision-dirty"
version=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
SECONDS=0
podman build --quiet --tag "$IMAGE" \
  --build-arg PYTHON_IMAGE="$BASE" \
  --build-arg VERSION="$version" \
  --build-arg REVISION="$revision" \
  --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  --volume "$wheels:/wheels:ro" \
  --volume "$CACHE/pip.conf:/etc/pip.conf:ro" \
  . >/dev/null
size=$(podman image inspect "$IMAGE" --format '{{.Size}}')
layers=$(podman image inspect "$IMAGE" --format '{{len .RootFS.Layers}}')
echo "$IMAGE: $((size / 1000000)) MB, $layers layers, built in ${SECONDS} s (base $BASE)"

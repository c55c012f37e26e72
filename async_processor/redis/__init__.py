"""What every Redis user shares: the daemon's transports, the Redis gates, the client
library and the operator tools.

- ``conn``: connecting (standalone, TLS, Sentinel, Cluster) and redis-py errors as ours.
- ``keys``: every key name and the result-list refusal rules.
- ``keyspace``: cluster hash tags, so a message's keys share a slot.
- ``lua/``: every script.
"""

"""``--transport gcp-pubsub``: a Pub/Sub subscription per queue, results published to a
topic (``transport`` is the seam's implementation; the other modules are its parts)."""

"""In-memory stand-ins for the daemon's seams, for unit tests that need no broker."""

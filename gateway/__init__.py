"""The stateless gateway: routing cache (router.py), forwarding (forward.py), call
streams to workers (calls.py) and the replies they share (reply.py), public API
(routes.py), process main (process.py)."""

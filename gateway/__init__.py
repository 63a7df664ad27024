"""The stateless gateway: routing cache (router.py), forwarding (forward.py),
public API (routes.py), process main (process.py)."""

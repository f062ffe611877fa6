"""How KV moves between the tiers: streams and events, the controller with its write (D2H) and
load (H2D) paths, acks, per-layer load events and the pages copies in flight keep busy."""

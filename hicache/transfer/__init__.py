"""How KV moves between the tiers: the controller (writes, loads, acks), its streams and events,
the per-layer load events, the pages copies in flight keep busy, and copy errors."""

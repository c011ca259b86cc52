"""The Ray cluster: actors, placement, transports, coordinator, engine API."""

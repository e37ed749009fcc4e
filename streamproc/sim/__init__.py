"""Simulated workers, traffic, the demo and an embedded nats-server. Nothing on the runtime path
imports this package."""

"""Public testkit: property laws every codec inherits, and a pure pipeline harness."""

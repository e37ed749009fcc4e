"""Helpers for the processor's neighbours: workers publishing chunks, readers following results, the
serving layer migrating a request."""

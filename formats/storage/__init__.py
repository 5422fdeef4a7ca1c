"""Reaching bytes: local folders and gs:// (listing, reads, ranged downloads, uploads, atomic publishes)."""

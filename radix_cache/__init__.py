"""radix_cache package."""

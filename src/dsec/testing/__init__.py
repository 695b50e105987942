"""Test support shipped with the product: a real single-node platform in a temp home."""

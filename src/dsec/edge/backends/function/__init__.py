"""Function backend: stateless calls in pre-forked isolated workers."""

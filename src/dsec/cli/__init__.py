"""The ``dsec`` command line: sandboxes, files, keys, and (from ``platform``) the platform."""

"""Full-VM backend: QEMU q35 booting a Debian system image (systemd, its own kernel)."""

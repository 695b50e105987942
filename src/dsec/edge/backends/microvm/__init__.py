"""microVM backend: QEMU microvm and Firecracker drivers behind one ``Vmm`` interface."""

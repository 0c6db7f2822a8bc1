"""Test support: servers, fake tools and nodes, the Kubernetes API double, FUSE filesystems."""

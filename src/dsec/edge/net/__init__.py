"""Per-sandbox networks: a netns + veth per sandbox, an nftables policy, a DNS resolver."""

"""reshard's Megatron planners: each turns one kind of Megatron source into the output plan of another layout."""

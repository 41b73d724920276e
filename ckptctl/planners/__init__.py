"""reshard's planners: each turns one kind of source into the output plan of another layout,
behind one interface (`request.ReshardRequest`)."""

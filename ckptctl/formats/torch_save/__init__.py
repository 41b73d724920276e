"""`torch.save` archives: the zip container and its records, read and written."""

"""bitcomm."""

"""Process groups and device communicators."""

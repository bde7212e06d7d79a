"""Third-party code kept inside leansft (see each folder's README.md)."""

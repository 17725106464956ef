"""What is kept on disk and fetched: the content store (content.py), the hub, files written whole, bounded reads of what a user brings, file faults said in one line."""

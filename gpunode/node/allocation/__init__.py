"""What Allocate and GetPreferredAllocation answer."""

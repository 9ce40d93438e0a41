"""Infrastructure shared by node and cluster: the HTTP layer, the Kubernetes client, systemd notification."""

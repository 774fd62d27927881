"""The ssdrbm gRPC training service: servicer, serving, configuration, Redis store and workers."""

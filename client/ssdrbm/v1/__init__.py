"""Generated gRPC stubs for package ``ssdrbm.v1`` (from protos/; never edit by hand)."""

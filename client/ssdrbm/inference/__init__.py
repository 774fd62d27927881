"""Open Inference Protocol (KServe v2) messages as ssdrbm serves them."""

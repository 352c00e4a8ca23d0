"""CCTStrategy: split each mini-batch across devices in proportion to their FLOPS."""

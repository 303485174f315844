"""World-size-free data position: the resumable sample stream."""

"""The control plane: sessions on the control socket, who may connect, channel segments, reloads."""

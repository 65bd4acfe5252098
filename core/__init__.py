"""reinforge.core: messages, the bus, the actor runtime, the cluster tools. Imports nothing from the other layers."""

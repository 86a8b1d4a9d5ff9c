"""The executable machine: `AllocatorModel` composing the contract's rules and the policies'
predictions, the state it keeps, and its declared interfaces (`seams`)."""

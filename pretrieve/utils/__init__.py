"""The ground floor: small utilities every layer may use; they import nothing else of pretrieve."""

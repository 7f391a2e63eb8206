"""The checks: what guards every tier (fingerprints, lengths, shapes, checksums, finiteness) and the stages where
faults may be injected."""

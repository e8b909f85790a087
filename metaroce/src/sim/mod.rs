//! Deterministic discrete-event network simulator (in progress).

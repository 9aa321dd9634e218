//! moor-controller (placeholder until the controller crate lands).

//! Test harness for moor privileged tests.

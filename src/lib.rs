//! Shared support for the examples and integration tests.

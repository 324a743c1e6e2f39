//! Compile tests of `#[derive(OutboxEvent)]`: valid inputs compile and behave
//! (`ui/pass`), invalid ones fail with the errors recorded next to them (`ui/fail/*.stderr`).
//!
//! After changing a message, regenerate the `.stderr` files with `TRYBUILD=overwrite` and
//! read them.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}

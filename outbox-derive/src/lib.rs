//! `#[derive(OutboxEvent)]` (placeholder; being written).
use proc_macro::TokenStream;

/// Derives `outbox_diesel::OutboxEvent`.
#[proc_macro_derive(OutboxEvent, attributes(outbox))]
pub fn derive_outbox_event(_input: TokenStream) -> TokenStream {
    TokenStream::new()
}

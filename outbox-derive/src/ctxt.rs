//! Error collection: every problem found in the input is recorded here and reported together
//! (serde_derive's `Ctxt`).

use quote::ToTokens;
use std::cell::RefCell;
use std::fmt::Display;

/// Collects the errors found while parsing and checking one derive input.
///
/// Consume it with [`Ctxt::check`] to get all errors combined into one [`syn::Error`], which
/// expands to one `compile_error!` per recorded error, each with its own span.
#[derive(Default)]
pub(crate) struct Ctxt {
    errors: RefCell<Vec<syn::Error>>,
}

impl Ctxt {
    /// An empty context.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Records an error spanned on `tokens` (from its first to its last token).
    pub(crate) fn error_spanned_by(&self, tokens: impl ToTokens, msg: impl Display) {
        self.errors
            .borrow_mut()
            .push(syn::Error::new_spanned(tokens.into_token_stream(), msg));
    }

    /// Records an error spanned on `span`.
    pub(crate) fn error_at(&self, span: proc_macro2::Span, msg: impl Display) {
        self.errors.borrow_mut().push(syn::Error::new(span, msg));
    }

    /// Records one of syn's parse errors.
    pub(crate) fn syn_error(&self, err: syn::Error) {
        self.errors.borrow_mut().push(err);
    }

    /// `Err` with every recorded error combined, in the order they were found, or `Ok` when
    /// there are none.
    pub(crate) fn check(self) -> syn::Result<()> {
        let mut errors = self.errors.into_inner().into_iter();
        let Some(mut combined) = errors.next() else {
            return Ok(());
        };
        for error in errors {
            combined.combine(error);
        }
        Err(combined)
    }
}

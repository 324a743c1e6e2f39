//! What an invalid input expands to: its errors, plus an impl whose bodies are never run, so
//! that code using the type reports no follow-on "trait not implemented" errors (thiserror's
//! `fallback.rs`).

use crate::valid::default_crate;
use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::{DeriveInput, Ident, Path};

/// The errors, and an `OutboxEvent` impl that satisfies the type checker.
pub(crate) fn expand(input: &DeriveInput, krate: Option<&Path>, errors: syn::Error) -> TokenStream {
    let default;
    let krate = match krate {
        Some(krate) => krate,
        None => {
            default = default_crate();
            &default
        }
    };
    // Spanned at the call site so that problems with the impl itself are not blamed on the
    // user's type name, which already carries our errors.
    let ty = Ident::new(&input.ident.to_string(), Span::call_site());
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let mut predicates: Vec<TokenStream> = where_clause
        .into_iter()
        .flat_map(|clause| clause.predicates.iter())
        .map(|predicate| quote!(#predicate))
        .collect();
    // The supertrait, assumed rather than required; `for<'workaround>` keeps the bound legal
    // on a type without parameters (trivial bounds are unstable, rust-lang/rust#48214), so a
    // union or a type that is also missing `Serialize` gets no extra error from this impl.
    predicates.push(quote!(for<'workaround> #ty #ty_generics: #krate::__private::serde::Serialize));
    let errors = errors.into_compile_error();

    quote! {
        #errors

        const _: () = {
            #[allow(unused_qualifications)]
            #[automatically_derived]
            impl #impl_generics #krate::OutboxEvent for #ty #ty_generics
            where
                #(#predicates),*
            {
                fn aggregate_type(&self) -> &::core::primitive::str {
                    ::core::unreachable!()
                }

                fn event_type(&self) -> &::core::primitive::str {
                    ::core::unreachable!()
                }

                fn aggregate_id(&self) -> ::std::string::String {
                    ::core::unreachable!()
                }
            }
        };
    }
}

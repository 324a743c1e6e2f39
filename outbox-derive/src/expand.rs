//! Code generation: the `OutboxEvent` impl of a checked input.

use crate::ast::Input;
use crate::ctxt::Ctxt;
use crate::fallback;
use crate::valid::{self, Checked, Event, Events};
use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{DeriveInput, Ident};

/// The whole derive: parse, check, then generate the impl, or the errors and a fallback impl.
pub(crate) fn derive(input: &DeriveInput) -> TokenStream {
    let cx = Ctxt::new();
    let ast = Input::from_syn(&cx, input);
    match valid::check(cx, &ast) {
        Ok(checked) => expand(&ast, &checked),
        Err(errors) => fallback::expand(input, ast.attrs.crate_path.as_ref(), errors),
    }
}

/// The `OutboxEvent` impl of a valid input.
pub(crate) fn expand(input: &Input<'_>, checked: &Checked<'_>) -> TokenStream {
    let krate = &checked.krate;
    let ident = input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let predicates = predicates(input, checked, where_clause);
    let where_clause = (!predicates.is_empty()).then(|| quote!(where #(#predicates),*));
    let aggregate_type = &checked.aggregate_type;
    let binding = Ident::new("__outbox_aggregate_id", Span::mixed_site());

    let (event_type, aggregate_id, event_types) = match &checked.events {
        Events::Struct(event) => {
            let member = &event.aggregate_id.member;
            let name = &event.event_type;
            (
                quote!(#name),
                to_string(event, quote!(&self.#member)),
                vec![name],
            )
        }
        Events::Enum(events) if events.is_empty() => {
            (quote!(match *self {}), quote!(match *self {}), Vec::new())
        }
        Events::Enum(events) => {
            let type_arms = events.iter().map(|event| {
                let variant = &event.variant;
                let name = &event.event_type;
                quote!(Self::#variant { .. } => #name,)
            });
            let id_arms = events.iter().map(|event| {
                let variant = &event.variant;
                let member = &event.aggregate_id.member;
                let to_string = to_string(event, binding.to_token_stream());
                quote!(Self::#variant { #member: #binding, .. } => #to_string,)
            });
            (
                quote!(match self { #(#type_arms)* }),
                quote!(match self { #(#id_arms)* }),
                events.iter().map(|event| &event.event_type).collect(),
            )
        }
    };

    quote! {
        const _: () = {
            #[automatically_derived]
            impl #impl_generics #krate::OutboxEvent for #ident #ty_generics #where_clause {
                fn aggregate_type(&self) -> &::core::primitive::str {
                    #aggregate_type
                }

                fn event_type(&self) -> &::core::primitive::str {
                    #event_type
                }

                fn aggregate_id(&self) -> ::std::string::String {
                    #aggregate_id
                }

                fn event_types() -> &'static [&'static ::core::primitive::str]
                where
                    Self: ::core::marker::Sized,
                {
                    &[#(#event_types),*]
                }
            }
        };
    }
}

/// `ToString::to_string(value)` through the field's type, spanned on that type so that a
/// type that does not implement `Display` is reported on the field.
fn to_string(event: &Event<'_>, value: TokenStream) -> TokenStream {
    let ty = event.aggregate_id.ty;
    quote_spanned!(ty.span()=> <#ty as ::std::string::ToString>::to_string(#value))
}

/// The where clause: the user's predicates, then `Self: Serialize` (the supertrait, which
/// serde's derive implements only under bounds on the type parameters) and
/// `FieldTy: Display` for each aggregate-id type that mentions a type or const parameter.
fn predicates(
    input: &Input<'_>,
    checked: &Checked<'_>,
    where_clause: Option<&syn::WhereClause>,
) -> Vec<TokenStream> {
    let mut predicates: Vec<TokenStream> = where_clause
        .into_iter()
        .flat_map(|clause| clause.predicates.iter())
        .map(ToTokens::to_token_stream)
        .collect();
    let params: Vec<String> = input
        .generics
        .type_params()
        .map(|param| param.ident.to_string())
        .chain(
            input
                .generics
                .const_params()
                .map(|param| param.ident.to_string()),
        )
        .collect();
    if params.is_empty() {
        return predicates;
    }
    if input.generics.type_params().next().is_some() {
        let krate = &checked.krate;
        predicates.push(quote!(Self: #krate::__private::serde::Serialize));
    }
    let events: Vec<&Event<'_>> = match &checked.events {
        Events::Struct(event) => vec![event],
        Events::Enum(events) => events.iter().collect(),
    };
    let mut bounded: Vec<String> = Vec::new();
    for event in events {
        let ty = event.aggregate_id.ty;
        let tokens = ty.to_token_stream();
        let key = tokens.to_string();
        if mentions(tokens, &params) && !bounded.contains(&key) {
            bounded.push(key);
            predicates.push(quote_spanned!(ty.span()=> #ty: ::core::fmt::Display));
        }
    }
    predicates
}

/// Whether `tokens` contain one of the identifiers `names`.
fn mentions(tokens: TokenStream, names: &[String]) -> bool {
    tokens.into_iter().any(|tree| match tree {
        TokenTree::Ident(ident) => names.iter().any(|name| ident == name),
        TokenTree::Group(group) => mentions(group.stream(), names),
        TokenTree::Punct(_) | TokenTree::Literal(_) => false,
    })
}

#[cfg(test)]
mod tests {
    use super::derive;
    use syn::DeriveInput;

    /// The generated code, pretty-printed for review. prettyplease works on syn 2's tree, so
    /// the tokens are re-parsed with syn 2.
    fn pretty(input: &DeriveInput) -> String {
        let tokens = derive(input);
        match syn2::parse2::<syn2::File>(tokens.clone()) {
            Ok(file) => prettyplease::unparse(&file),
            Err(err) => panic!("generated code does not parse ({err}):\n{tokens}"),
        }
    }

    #[test]
    fn struct_with_named_fields() {
        let input: DeriveInput = syn::parse_quote! {
            #[derive(Serialize, OutboxEvent)]
            #[outbox(aggregate_type = "order", event_type = "order.placed")]
            struct OrderPlaced {
                #[outbox(aggregate_id)]
                order_id: i64,
                total_cents: i64,
            }
        };
        insta::assert_snapshot!(pretty(&input));
    }

    #[test]
    fn tuple_struct_with_default_event_type() {
        let input: DeriveInput = syn::parse_quote! {
            #[outbox(aggregate_type = "parcel", rename_all = "kebab-case")]
            struct ParcelShipped(String, #[outbox(aggregate_id)] u64);
        };
        insta::assert_snapshot!(pretty(&input));
    }

    #[test]
    fn enum_with_named_and_tuple_variants() {
        let input: DeriveInput = syn::parse_quote! {
            #[derive(Serialize, OutboxEvent)]
            #[outbox(aggregate_type = "order", rename_all = "kebab-case")]
            enum OrderEvent {
                Placed { #[outbox(aggregate_id)] id: Uuid, total: i64 },
                #[outbox(event_type = "order.cancelled")]
                Cancelled(#[outbox(aggregate_id)] Uuid),
                LineAdded { line: u32, #[outbox(aggregate_id)] order: Uuid },
            }
        };
        insta::assert_snapshot!(pretty(&input));
    }

    #[test]
    fn generic_struct_with_where_clause() {
        let input: DeriveInput = syn::parse_quote! {
            #[outbox(aggregate_type = "account", crate = "my_app::outbox")]
            struct Credited<'a, Id, M: Clone>
            where
                M: Default,
            {
                #[outbox(aggregate_id)]
                account: Id,
                reference: &'a str,
                meta: M,
            }
        };
        insta::assert_snapshot!(pretty(&input));
    }

    #[test]
    fn invalid_input_gets_errors_and_a_fallback_impl() {
        let input: DeriveInput = syn::parse_quote! {
            #[outbox(agregate_type = "order")]
            struct OrderPlaced {
                order_id: i64,
            }
        };
        insta::assert_snapshot!(pretty(&input));
    }
}

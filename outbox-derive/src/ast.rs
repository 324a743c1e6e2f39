//! The derive input in typed form: syn's tree with the `#[outbox(...)]` settings parsed.
//!
//! Building it records attribute errors but rejects nothing: every shape of input (even a
//! union) has a typed form, so that [`crate::valid`] can report all problems at once.

use crate::attr;
use crate::ctxt::Ctxt;
use syn::{DeriveInput, Generics, Ident, Index, Member, Type};

/// The type deriving `OutboxEvent`.
pub(crate) struct Input<'a> {
    /// The type's name.
    pub ident: &'a Ident,
    /// The type's generics, with the user's where clause.
    pub generics: &'a Generics,
    /// The container settings.
    pub attrs: attr::Container,
    /// What kind of type it is, with its fields or variants.
    pub data: Data<'a>,
}

/// The body of the type.
pub(crate) enum Data<'a> {
    /// A struct: one event type.
    Struct(Struct<'a>),
    /// An enum: one event type per variant.
    Enum(Vec<Variant<'a>>),
    /// A union: not supported; kept to span the error on the `union` keyword.
    Union(&'a syn::token::Union),
}

/// A struct's fields.
pub(crate) struct Struct<'a> {
    /// Braces, parentheses or none.
    pub style: Style,
    /// The fields, in order.
    pub fields: Vec<Field<'a>>,
}

/// An enum variant.
pub(crate) struct Variant<'a> {
    /// The variant's name.
    pub ident: &'a Ident,
    /// The variant settings.
    pub attrs: attr::Variant,
    /// Braces, parentheses or none.
    pub style: Style,
    /// The fields, in order.
    pub fields: Vec<Field<'a>>,
}

/// How a struct or variant holds its fields.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Style {
    /// `{ a: A }`
    Named,
    /// `(A)`
    Tuple,
    /// no fields at all
    Unit,
}

/// A field of a struct or variant.
pub(crate) struct Field<'a> {
    /// How to reach it: `self.order_id` or `self.0`.
    pub member: Member,
    /// Its type.
    pub ty: &'a Type,
    /// The field settings.
    pub attrs: attr::Field,
}

impl<'a> Input<'a> {
    /// Reads `input`, recording attribute errors in `cx`.
    pub(crate) fn from_syn(cx: &Ctxt, input: &'a DeriveInput) -> Self {
        let attrs = attr::container(cx, &input.attrs);
        let data = match &input.data {
            syn::Data::Struct(data) => Data::Struct(Struct {
                style: Style::of(&data.fields),
                fields: fields(cx, &data.fields),
            }),
            syn::Data::Enum(data) => Data::Enum(
                data.variants
                    .iter()
                    .map(|variant| Variant {
                        ident: &variant.ident,
                        attrs: attr::variant(cx, &variant.attrs),
                        style: Style::of(&variant.fields),
                        fields: fields(cx, &variant.fields),
                    })
                    .collect(),
            ),
            syn::Data::Union(data) => Data::Union(&data.union_token),
        };
        Input {
            ident: &input.ident,
            generics: &input.generics,
            attrs,
            data,
        }
    }
}

impl Style {
    fn of(fields: &syn::Fields) -> Self {
        match fields {
            syn::Fields::Named(_) => Style::Named,
            syn::Fields::Unnamed(_) => Style::Tuple,
            syn::Fields::Unit => Style::Unit,
        }
    }
}

impl<'a> Field<'a> {
    /// The field's `aggregate_id` key, if it is marked as the aggregate id.
    pub(crate) fn aggregate_id(&self) -> Option<&syn::Path> {
        self.attrs.aggregate_id.as_ref()
    }
}

fn fields<'a>(cx: &Ctxt, fields: &'a syn::Fields) -> Vec<Field<'a>> {
    fields
        .iter()
        .enumerate()
        .map(|(i, field)| Field {
            member: match &field.ident {
                Some(ident) => Member::Named(ident.clone()),
                None => Member::Unnamed(Index::from(i)),
            },
            ty: &field.ty,
            attrs: attr::field(cx, &field.attrs),
        })
        .collect()
}

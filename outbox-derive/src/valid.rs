//! Rules that relate settings to each other and to the shape of the type, and the checks of
//! names against NATS subject syntax.
//!
//! [`check`] records every violation, then either reports them all or returns the
//! [`Checked`] form that code generation works from.

use crate::ast::{Data, Field, Input, Style};
use crate::attr::Written;
use crate::case::RenameRule;
use crate::ctxt::Ctxt;
use proc_macro2::Span;
use syn::{Ident, LitStr, Member, Path};

/// A valid input, resolved for code generation.
pub(crate) struct Checked<'a> {
    /// The aggregate type, a valid subject token.
    pub aggregate_type: String,
    /// The path to outbox_diesel (`::outbox_diesel` unless `crate = "..."` says otherwise).
    pub krate: Path,
    /// The event the struct is, or the events of the enum's variants.
    pub events: Events<'a>,
}

/// The events a type produces.
pub(crate) enum Events<'a> {
    /// A struct: always the same event type.
    Struct(Event<'a>),
    /// An enum: one event per variant, in declaration order.
    Enum(Vec<Event<'a>>),
}

/// One event type and where its aggregate id comes from.
pub(crate) struct Event<'a> {
    /// The variant, for an enum.
    pub variant: Option<&'a Ident>,
    /// The event type, valid and unique within the type.
    pub event_type: String,
    /// The field marked `#[outbox(aggregate_id)]`.
    pub aggregate_id: &'a Field<'a>,
}

/// The default `crate = "..."`.
pub(crate) fn default_crate() -> Path {
    syn::parse_quote!(::outbox_diesel)
}

/// Checks `input` and returns its checked form, or every error found (including those that
/// `cx` collected while parsing attributes).
pub(crate) fn check<'a>(cx: Ctxt, input: &'a Input<'a>) -> syn::Result<Checked<'a>> {
    let aggregate_type = aggregate_type(&cx, input);
    let rename = input.attrs.rename_all.unwrap_or(RenameRule::Snake);
    let events = match &input.data {
        Data::Union(token) => {
            cx.error_spanned_by(
                token,
                "`OutboxEvent` cannot be derived for a union; use a struct, or an enum with one variant per event type",
            );
            None
        }
        Data::Struct(data) => {
            let owner = Owner::Struct(input.ident);
            let explicit = input.attrs.event_type.as_ref().map(|s| &s.value);
            let event_type = event_type(&cx, explicit, input.ident, rename);
            let owner_written = &input.attrs.written;
            let aggregate_id = aggregate_id(&cx, owner, owner_written, data.style, &data.fields);
            match (event_type, aggregate_id) {
                (Some(event_type), Some(aggregate_id)) => Some(Events::Struct(Event {
                    variant: None,
                    event_type,
                    aggregate_id,
                })),
                _ => None,
            }
        }
        Data::Enum(variants) => {
            if let Some(setting) = &input.attrs.event_type {
                cx.error_spanned_by(
                    &setting.key,
                    "`event_type` cannot go on an enum: each variant has its own event type\nhelp: put `#[outbox(event_type = \"...\")]` on the variants, or let `rename_all` derive the event types from the variant names",
                );
            }
            let mut events = Some(Vec::with_capacity(variants.len()));
            let mut taken: Vec<(String, &Ident)> = Vec::new();
            for variant in variants {
                let explicit = variant.attrs.event_type.as_ref();
                let event_type = event_type(&cx, explicit, variant.ident, rename);
                if let Some(name) = &event_type {
                    if let Some((_, first)) = taken.iter().find(|(taken, _)| taken == name) {
                        match explicit {
                            Some(lit) => cx.error_spanned_by(
                                lit,
                                format_args!(
                                    "event type \"{name}\" is already the event type of variant `{first}`; every variant needs its own"
                                ),
                            ),
                            None => cx.error_at(
                                variant.ident.span(),
                                format_args!(
                                    "event type \"{name}\", made from the name `{}`, is already the event type of variant `{first}`; every variant needs its own\nhelp: give this variant another with `#[outbox(event_type = \"...\")]`",
                                    variant.ident
                                ),
                            ),
                        }
                    } else {
                        taken.push((name.clone(), variant.ident));
                    }
                }
                let owner = Owner::Variant(variant.ident);
                let owner_written = &variant.attrs.written;
                let aggregate_id =
                    aggregate_id(&cx, owner, owner_written, variant.style, &variant.fields);
                match (event_type, aggregate_id, events.as_mut()) {
                    (Some(event_type), Some(aggregate_id), Some(list)) => list.push(Event {
                        variant: Some(variant.ident),
                        event_type,
                        aggregate_id,
                    }),
                    _ => events = None,
                }
            }
            events.map(Events::Enum)
        }
    };
    cx.check()?;
    match (aggregate_type, events) {
        (Some(aggregate_type), Some(events)) => Ok(Checked {
            aggregate_type,
            krate: input.attrs.crate_path.clone().unwrap_or_else(default_crate),
            events,
        }),
        _ => Err(syn::Error::new(
            Span::call_site(),
            "outbox-derive internal error: the input was rejected without a reason; please report this",
        )),
    }
}

/// The struct or variant that holds some fields, to name it in messages.
#[derive(Clone, Copy)]
enum Owner<'a> {
    Struct(&'a Ident),
    Variant(&'a Ident),
}

impl Owner<'_> {
    fn span(self) -> Span {
        match self {
            Owner::Struct(ident) | Owner::Variant(ident) => ident.span(),
        }
    }

    fn name(self) -> String {
        match self {
            Owner::Struct(ident) => format!("`{ident}`"),
            Owner::Variant(ident) => format!("variant `{ident}`"),
        }
    }
}

/// The required, valid aggregate type; records an error when it is missing or invalid.
fn aggregate_type(cx: &Ctxt, input: &Input<'_>) -> Option<String> {
    let Some(lit) = &input.attrs.aggregate_type else {
        if input.attrs.written.contains("aggregate_type") {
            // Misspelt or given a wrong value: already reported.
            return None;
        }
        cx.error_at(
            input.ident.span(),
            "missing `aggregate_type`: an outbox event must name the kind of aggregate it belongs to\nhelp: the correct form is `#[outbox(aggregate_type = \"order\")]`",
        );
        return None;
    };
    let value = lit.value();
    match check_subject_token(&value) {
        Ok(()) => Some(value),
        Err(why) => {
            cx.error_spanned_by(
                lit,
                format_args!(
                    "invalid aggregate_type \"{}\": {why}\nhelp: an aggregate type is a single NATS subject token, without `.`, `*`, `>`, white space or control characters, e.g. \"order\"",
                    value.escape_debug()
                ),
            );
            None
        }
    }
}

/// The valid event type of a struct or variant named `ident`: the explicit one, or the
/// name converted by `rename`. Records an error when it is invalid.
fn event_type(
    cx: &Ctxt,
    explicit: Option<&LitStr>,
    ident: &Ident,
    rename: RenameRule,
) -> Option<String> {
    const HELP: &str = "help: an event type is one or more `.`-separated NATS subject tokens, without `*`, `>`, white space or control characters, e.g. \"order.placed\"";
    match explicit {
        Some(lit) => {
            let value = lit.value();
            match check_event_type(&value) {
                Ok(()) => Some(value),
                Err(why) => {
                    cx.error_spanned_by(
                        lit,
                        format_args!(
                            "invalid event_type \"{}\": {why}\n{HELP}",
                            value.escape_debug()
                        ),
                    );
                    None
                }
            }
        }
        None => {
            use syn::ext::IdentExt;
            let value = rename.apply(&ident.unraw().to_string());
            match check_event_type(&value) {
                Ok(()) => Some(value),
                Err(why) => {
                    cx.error_at(
                        ident.span(),
                        format_args!(
                            "the default event type \"{}\" made from `{ident}` is invalid: {why}\nhelp: give one with `#[outbox(event_type = \"...\")]`",
                            value.escape_debug()
                        ),
                    );
                    None
                }
            }
        }
    }
}

/// The one field marked as the aggregate id; records an error when there is none or more.
/// `owner_written` are the keys on the struct or variant itself, where a misplaced
/// `aggregate_id` has already been reported.
fn aggregate_id<'a>(
    cx: &Ctxt,
    owner: Owner<'_>,
    owner_written: &Written,
    style: Style,
    fields: &'a [Field<'a>],
) -> Option<&'a Field<'a>> {
    let mut marked = fields.iter().filter(|field| field.aggregate_id().is_some());
    let Some(first) = marked.next() else {
        if owner_written.contains("aggregate_id")
            || fields
                .iter()
                .any(|field| field.attrs.written.contains("aggregate_id"))
        {
            // Misspelt, given a value or put on the struct or variant: already reported.
            return None;
        }
        let msg = if style == Style::Unit {
            match owner {
                Owner::Struct(_) => format!(
                    "{} is a unit struct, so it has no field to be the aggregate id\nhelp: add the field that identifies the aggregate and mark it `#[outbox(aggregate_id)]`",
                    owner.name()
                ),
                Owner::Variant(_) => format!(
                    "{} has no fields, so it has no field to be the aggregate id\nhelp: add the field that identifies the aggregate and mark it `#[outbox(aggregate_id)]`",
                    owner.name()
                ),
            }
        } else {
            format!(
                "no field of {} is marked as the aggregate id\nhelp: mark the field that identifies the aggregate with `#[outbox(aggregate_id)]`; its type must implement `Display`",
                owner.name()
            )
        };
        cx.error_at(owner.span(), msg);
        return None;
    };
    let mut doubled = false;
    for extra in marked {
        doubled = true;
        let field = match &first.member {
            Member::Named(ident) => ident.to_string(),
            Member::Unnamed(index) => index.index.to_string(),
        };
        if let Some(key) = extra.aggregate_id() {
            cx.error_spanned_by(
                key,
                format_args!(
                    "{} already has its aggregate id in field `{field}`; an event has exactly one aggregate id",
                    owner.name()
                ),
            );
        }
    }
    (!doubled).then_some(first)
}

/// Why a name cannot be a NATS subject token (mirrors `outbox_diesel::TokenError`, with
/// messages that explain the rule at compile time).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Invalid {
    /// The whole name is empty.
    Empty,
    /// The name starts with `.`.
    LeadingDot,
    /// The name ends with `.`.
    TrailingDot,
    /// The name has `..`.
    EmptyPart,
    /// The name contains this character.
    Forbidden(char),
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalid::Empty => f.write_str("it is empty"),
            Invalid::LeadingDot => f.write_str("it starts with '.', leaving an empty token"),
            Invalid::TrailingDot => f.write_str("it ends with '.', leaving an empty token"),
            Invalid::EmptyPart => {
                f.write_str("it has '..', leaving an empty token between the dots")
            }
            Invalid::Forbidden('.') => {
                f.write_str("it contains '.', which would split it into two subject tokens")
            }
            Invalid::Forbidden(c @ ('*' | '>')) => {
                write!(f, "it contains {c:?}, a subject wildcard")
            }
            Invalid::Forbidden(c) if c.is_whitespace() => {
                write!(
                    f,
                    "it contains {c:?}, and white space cannot appear in a subject"
                )
            }
            Invalid::Forbidden(c) => write!(
                f,
                "it contains {c:?}, and control characters cannot appear in a subject"
            ),
        }
    }
}

/// Same rule as `outbox_diesel::check_subject_token`: not empty, and free of `.`, `*`, `>`,
/// white space and control characters.
pub(crate) fn check_subject_token(name: &str) -> Result<(), Invalid> {
    if name.is_empty() {
        return Err(Invalid::Empty);
    }
    match name
        .chars()
        .find(|&c| c == '.' || c == '*' || c == '>' || c.is_whitespace() || c.is_control())
    {
        Some(c) => Err(Invalid::Forbidden(c)),
        None => Ok(()),
    }
}

/// Same rule as `outbox_diesel::check_event_type`: one or more `.`-separated subject tokens.
pub(crate) fn check_event_type(name: &str) -> Result<(), Invalid> {
    if name.is_empty() {
        return Err(Invalid::Empty);
    }
    let parts: Vec<&str> = name.split('.').collect();
    let last = parts.len() - 1;
    for (i, part) in parts.iter().enumerate() {
        match check_subject_token(part) {
            Ok(()) => {}
            Err(Invalid::Empty) if i == 0 => return Err(Invalid::LeadingDot),
            Err(Invalid::Empty) if i == last => return Err(Invalid::TrailingDot),
            Err(Invalid::Empty) => return Err(Invalid::EmptyPart),
            Err(other) => return Err(other),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Invalid, check_event_type, check_subject_token};

    #[test]
    fn subject_tokens() {
        assert_eq!(check_subject_token("order"), Ok(()));
        assert_eq!(check_subject_token("order_line-2"), Ok(()));
        assert_eq!(check_subject_token(""), Err(Invalid::Empty));
        assert_eq!(check_subject_token("or.der"), Err(Invalid::Forbidden('.')));
        assert_eq!(check_subject_token("or*"), Err(Invalid::Forbidden('*')));
        assert_eq!(check_subject_token(">"), Err(Invalid::Forbidden('>')));
        assert_eq!(check_subject_token("or der"), Err(Invalid::Forbidden(' ')));
        assert_eq!(
            check_subject_token("or\u{7}"),
            Err(Invalid::Forbidden('\u{7}'))
        );
        assert_eq!(
            check_subject_token("a\u{a0}b"),
            Err(Invalid::Forbidden('\u{a0}'))
        );
    }

    #[test]
    fn event_types() {
        assert_eq!(check_event_type("order.placed"), Ok(()));
        assert_eq!(check_event_type("placed"), Ok(()));
        assert_eq!(check_event_type(""), Err(Invalid::Empty));
        assert_eq!(check_event_type(".placed"), Err(Invalid::LeadingDot));
        assert_eq!(check_event_type("order."), Err(Invalid::TrailingDot));
        assert_eq!(check_event_type("order..placed"), Err(Invalid::EmptyPart));
        assert_eq!(check_event_type("."), Err(Invalid::LeadingDot));
        assert_eq!(check_event_type("order.*"), Err(Invalid::Forbidden('*')));
        assert_eq!(check_event_type("order.>"), Err(Invalid::Forbidden('>')));
        assert_eq!(
            check_event_type("order placed"),
            Err(Invalid::Forbidden(' '))
        );
    }

    #[test]
    fn messages_explain_the_rule() {
        assert_eq!(
            Invalid::Forbidden('*').to_string(),
            "it contains '*', a subject wildcard"
        );
        assert_eq!(
            Invalid::Forbidden('\t').to_string(),
            "it contains '\\t', and white space cannot appear in a subject"
        );
    }
}

//! Parsing of `#[outbox(...)]` attributes into typed settings.
//!
//! Every problem is recorded in the [`Ctxt`] with the span of the offending key, value or
//! attribute, and parsing goes on with the next key, so that one compilation reports them
//! all. Rules that relate several settings (or settings and the shape of the type) belong to
//! [`crate::valid`].

use crate::case::{RULES, RenameRule};
use crate::ctxt::Ctxt;
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::punctuated::Punctuated;
use syn::{Attribute, Expr, ExprLit, Lit, LitStr, Meta, Path, Token};

/// A setting's value together with the key that set it, kept to span errors on the key.
pub(crate) struct Setting<T> {
    /// The key as written (`event_type`).
    pub key: Path,
    /// The value it was given.
    pub value: T,
}

/// Settings of the struct or enum: `#[outbox(...)]` above the type.
#[derive(Default)]
pub(crate) struct Container {
    /// `aggregate_type = "order"`, required.
    pub aggregate_type: Option<LitStr>,
    /// `event_type = "order.placed"`: structs only (an enum is rejected by `valid`).
    pub event_type: Option<Setting<LitStr>>,
    /// `rename_all = "kebab-case"`, if given and valid.
    pub rename_all: Option<RenameRule>,
    /// `crate = "path::to::outbox_diesel"`, if given and a valid path.
    pub crate_path: Option<Path>,
    /// Keys the user wrote or evidently meant, valid or not (see [`Written`]).
    pub written: Written,
}

/// Settings of an enum variant.
#[derive(Default)]
pub(crate) struct Variant {
    /// `event_type = "order.cancelled"`.
    pub event_type: Option<LitStr>,
    /// Keys the user wrote or evidently meant, valid or not (see [`Written`]).
    pub written: Written,
}

/// Settings of a field.
#[derive(Default)]
pub(crate) struct Field {
    /// The `aggregate_id` key, when the field is marked as the aggregate id.
    pub aggregate_id: Option<Path>,
    /// Keys the user wrote or evidently meant, valid or not (see [`Written`]).
    pub written: Written,
}

/// The keys an item's attributes set, including those whose value was rejected, those a
/// misspelt key most likely meant, and those put on the wrong item.
///
/// An error has already been reported for those; `valid` consults this to avoid following
/// it with "missing `aggregate_type`" or "no field is marked as the aggregate id".
#[derive(Default)]
pub(crate) struct Written {
    keys: Vec<&'static str>,
    /// An `#[outbox...]` attribute could not be read, so it may have set any key.
    unreadable: bool,
}

impl Written {
    /// Whether `key` was written (or meant), or may have been.
    pub(crate) fn contains(&self, key: &str) -> bool {
        self.unreadable || self.keys.contains(&key)
    }
}

/// Where an `#[outbox(...)]` attribute sits; decides which keys are allowed there.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    Container,
    Variant,
    Field,
}

/// Every key, with where it is allowed and an example of its correct form.
#[rustfmt::skip]
const KEYS: &[(&str, Place, &str)] = &[
    ("aggregate_type", Place::Container, "aggregate_type = \"order\""),
    ("event_type", Place::Container, "event_type = \"order.placed\""),
    ("rename_all", Place::Container, "rename_all = \"kebab-case\""),
    ("crate", Place::Container, "crate = \"my_crate::outbox\""),
    ("event_type", Place::Variant, "event_type = \"order.placed\""),
    ("aggregate_id", Place::Field, "aggregate_id"),
];

impl Place {
    /// The keys allowed here, in the order the docs list them.
    fn keys(self) -> impl Iterator<Item = &'static str> {
        KEYS.iter()
            .filter(move |(_, place, _)| *place == self)
            .map(|(key, _, _)| *key)
    }

    /// An example attribute for this place, for "expected `#[outbox(...)]`" messages.
    fn example(self) -> &'static str {
        match self {
            Place::Container => "#[outbox(aggregate_type = \"order\")]",
            Place::Variant => "#[outbox(event_type = \"order.placed\")]",
            Place::Field => "#[outbox(aggregate_id)]",
        }
    }
}

/// The correct form of `key` (`aggregate_type = "order"`).
fn form(key: &str) -> &'static str {
    KEYS.iter()
        .find(|(k, _, _)| *k == key)
        .map_or("", |(_, _, form)| *form)
}

/// Why `key`, valid elsewhere, is not allowed at `place`; `None` if it is not a known key.
fn misplaced(key: &str, place: Place) -> Option<&'static str> {
    match (key, place) {
        ("aggregate_id", Place::Container | Place::Variant) => Some(
            "`aggregate_id` goes on a field: mark the field that identifies the aggregate with `#[outbox(aggregate_id)]`",
        ),
        ("aggregate_type", Place::Variant) => Some(
            "`aggregate_type` goes on the enum, not on a variant: all variants share the enum's aggregate type",
        ),
        ("rename_all", Place::Variant) => Some(
            "`rename_all` goes on the enum, not on a variant; a variant takes `event_type = \"...\"`",
        ),
        ("crate", Place::Variant) => Some("`crate` goes on the enum, not on a variant"),
        ("event_type", Place::Field) => {
            Some("`event_type` goes on the struct or on an enum variant, not on a field")
        }
        ("aggregate_type", Place::Field) => {
            Some("`aggregate_type` goes on the struct or enum, not on a field")
        }
        ("rename_all", Place::Field) => {
            Some("`rename_all` goes on the struct or enum, not on a field")
        }
        ("crate", Place::Field) => Some("`crate` goes on the struct or enum, not on a field"),
        _ => None,
    }
}

/// Parses the `#[outbox(...)]` attributes of a struct or enum.
pub(crate) fn container(cx: &Ctxt, attrs: &[Attribute]) -> Container {
    let mut out = Container::default();
    let mut seen = Seen::default();
    for meta in outbox_metas(cx, attrs, Place::Container, &mut out.written) {
        let Some(key) = key_of(cx, &meta, Place::Container, &mut out.written) else {
            continue;
        };
        if !seen.first(cx, &meta, key) {
            continue;
        }
        match key {
            "aggregate_type" => out.aggregate_type = string(cx, &meta, key),
            "event_type" => {
                out.event_type = string(cx, &meta, key).map(|value| Setting {
                    key: meta.path().clone(),
                    value,
                });
            }
            "rename_all" => {
                out.rename_all = string(cx, &meta, key).and_then(|lit| rename(cx, &lit))
            }
            "crate" => {
                out.crate_path = string(cx, &meta, key).and_then(|lit| match lit.parse::<Path>() {
                    Ok(path) => Some(path),
                    Err(_) => {
                        cx.error_spanned_by(
                            &lit,
                            format_args!(
                                "`{}` is not a path; `crate` takes the path of outbox_diesel or of a module that re-exports it, e.g. `crate = \"my_crate::outbox\"`",
                                lit.value()
                            ),
                        );
                        None
                    }
                });
            }
            _ => {}
        }
    }
    out
}

/// Parses the `#[outbox(...)]` attributes of an enum variant.
pub(crate) fn variant(cx: &Ctxt, attrs: &[Attribute]) -> Variant {
    let mut out = Variant::default();
    let mut seen = Seen::default();
    for meta in outbox_metas(cx, attrs, Place::Variant, &mut out.written) {
        let Some(key) = key_of(cx, &meta, Place::Variant, &mut out.written) else {
            continue;
        };
        if seen.first(cx, &meta, key) && key == "event_type" {
            out.event_type = string(cx, &meta, key);
        }
    }
    out
}

/// Parses the `#[outbox(...)]` attributes of a field.
pub(crate) fn field(cx: &Ctxt, attrs: &[Attribute]) -> Field {
    let mut out = Field::default();
    let mut seen = Seen::default();
    for meta in outbox_metas(cx, attrs, Place::Field, &mut out.written) {
        let Some(key) = key_of(cx, &meta, Place::Field, &mut out.written) else {
            continue;
        };
        if seen.first(cx, &meta, key) && key == "aggregate_id" {
            out.aggregate_id = flag(cx, &meta, key);
        }
    }
    out
}

/// The `key = value` items of every `#[outbox(...)]` among `attrs`, in order. Marks
/// `written` as unreadable when an attribute cannot be read.
fn outbox_metas(cx: &Ctxt, attrs: &[Attribute], place: Place, written: &mut Written) -> Vec<Meta> {
    let mut metas = Vec::new();
    for attr in attrs.iter().filter(|attr| attr.path().is_ident("outbox")) {
        match &attr.meta {
            Meta::List(list) => {
                match list.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated) {
                    Ok(items) => metas.extend(items),
                    Err(err) => {
                        cx.syn_error(err);
                        written.unreadable = true;
                    }
                }
            }
            other => {
                cx.error_spanned_by(
                    other,
                    format_args!("expected `#[outbox(...)]`, e.g. `{}`", place.example()),
                );
                written.unreadable = true;
            }
        }
    }
    metas
}

/// The known key `meta` sets at `place`, or `None` after recording why it is not allowed.
/// Adds the key to `written`, or for a misspelt key the key it most likely means.
fn key_of(cx: &Ctxt, meta: &Meta, place: Place, written: &mut Written) -> Option<&'static str> {
    let path = meta.path();
    let name = match path.get_ident() {
        Some(ident) => ident.unraw().to_string(),
        None => path.to_token_stream().to_string().replace(' ', ""),
    };
    if let Some(key) = place.keys().find(|key| *key == name) {
        written.keys.push(key);
        return Some(key);
    }
    if let Some(why) = misplaced(&name, place) {
        if let Some(key) = KEYS.iter().map(|(key, _, _)| *key).find(|key| *key == name) {
            written.keys.push(key);
        }
        cx.error_spanned_by(path, why);
        return None;
    }
    let expected: Vec<&str> = place.keys().collect();
    let list = match expected.as_slice() {
        [only] => format!("`{only}`"),
        many => format!(
            "one of {}",
            many.iter()
                .map(|key| format!("`{key}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut msg = format!("unknown outbox attribute `{name}`; expected {list}");
    if let Some(near) = nearest(&name, &expected) {
        written.keys.push(near);
        if expected.len() > 1 {
            msg.push_str(&format!("\nhelp: did you mean `{near}`?"));
        }
    } else {
        let elsewhere: Vec<&str> = KEYS.iter().map(|(key, _, _)| *key).collect();
        if let Some((near, why)) =
            nearest(&name, &elsewhere).and_then(|near| Some((near, misplaced(near, place)?)))
        {
            msg.push_str(&format!("\nhelp: did you mean `{near}`? {why}"));
        }
    }
    cx.error_spanned_by(path, msg);
    None
}

/// The keys already set on one item, to reject a second `key`.
#[derive(Default)]
struct Seen(Vec<&'static str>);

impl Seen {
    /// Whether this is the first time `key` is set; records an error on the key if not.
    fn first(&mut self, cx: &Ctxt, meta: &Meta, key: &'static str) -> bool {
        if self.0.contains(&key) {
            cx.error_spanned_by(
                meta.path(),
                format_args!("duplicate outbox attribute `{key}`; it may be given only once"),
            );
            false
        } else {
            self.0.push(key);
            true
        }
    }
}

/// The string literal of `key = "..."`, or `None` after recording why `meta` is not that.
fn string(cx: &Ctxt, meta: &Meta, key: &str) -> Option<LitStr> {
    let form = form(key);
    match meta {
        Meta::NameValue(nv) => match lit_str(&nv.value) {
            Some(lit) => Some(lit.clone()),
            None => {
                cx.error_spanned_by(
                    &nv.value,
                    format_args!("expected a string literal: `{form}`"),
                );
                None
            }
        },
        Meta::Path(path) => {
            cx.error_spanned_by(path, format_args!("`{key}` needs a value: `{form}`"));
            None
        }
        Meta::List(_) => {
            cx.error_spanned_by(meta, format_args!("expected `{form}`, not `{key}(...)`"));
            None
        }
    }
}

/// The key of a bare-word `key`, or `None` after recording why `meta` is not that.
fn flag(cx: &Ctxt, meta: &Meta, key: &str) -> Option<Path> {
    match meta {
        Meta::Path(path) => Some(path.clone()),
        Meta::NameValue(_) | Meta::List(_) => {
            cx.error_spanned_by(
                meta,
                format_args!("`{key}` takes no value: write `#[outbox({key})]`"),
            );
            None
        }
    }
}

/// `expr` as a string literal, looking through the invisible groups of `macro_rules!` input.
fn lit_str(expr: &Expr) -> Option<&LitStr> {
    match expr {
        Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) => Some(lit),
        Expr::Group(group) => lit_str(&group.expr),
        _ => None,
    }
}

/// The rule named by `lit`, or `None` after recording an error on the literal.
fn rename(cx: &Ctxt, lit: &LitStr) -> Option<RenameRule> {
    let name = lit.value();
    if let Some(rule) = RenameRule::from_name(&name) {
        return Some(rule);
    }
    let spellings: Vec<&str> = RULES.iter().map(|(spelling, _)| *spelling).collect();
    let mut msg = format!(
        "unknown rename_all rule \"{name}\"; expected one of {}",
        spellings
            .iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(near) = nearest(&name, &spellings) {
        msg.push_str(&format!("\nhelp: did you mean \"{near}\"?"));
    }
    cx.error_spanned_by(lit, msg);
    None
}

/// The candidate closest to `input` if it is close enough to be a likely typo.
///
/// Compares case-insensitively and ignoring `_` and `-`, by edit distance (adjacent
/// transpositions count as one edit) or as an abbreviation (`kebab` for `kebab-case`).
pub(crate) fn nearest<'a>(input: &str, candidates: &[&'a str]) -> Option<&'a str> {
    fn normal(s: &str) -> Vec<char> {
        s.chars()
            .filter(|c| *c != '_' && *c != '-')
            .map(|c| c.to_ascii_lowercase())
            .collect()
    }
    let wanted = normal(input);
    if wanted.is_empty() {
        return None;
    }
    let limit = (wanted.len() / 3).max(1);
    candidates
        .iter()
        .filter_map(|&candidate| {
            let have = normal(candidate);
            let score = if wanted.len() >= 3 && have.starts_with(&wanted) {
                0
            } else {
                distance(&wanted, &have)
            };
            (score <= limit).then_some((
                score,
                distance(&chars(input), &chars(candidate)),
                candidate,
            ))
        })
        .min_by_key(|&(score, raw, _)| (score, raw))
        .map(|(_, _, candidate)| candidate)
}

fn chars(s: &str) -> Vec<char> {
    s.chars().collect()
}

/// Optimal string alignment distance between `a` and `b`.
fn distance(a: &[char], b: &[char]) -> usize {
    let width = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * width];
    for (i, row) in d.chunks_mut(width).enumerate() {
        row[0] = i;
    }
    for (j, cell) in d.iter_mut().take(width).enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[(i - 1) * width + j] + 1)
                .min(d[i * width + j - 1] + 1)
                .min(d[(i - 1) * width + j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[(i - 2) * width + j - 2] + 1);
            }
            d[i * width + j] = best;
        }
    }
    d[a.len() * width + b.len()]
}

#[cfg(test)]
mod tests {
    use super::nearest;

    #[test]
    fn suggests_close_keys_only() {
        let keys = [
            "aggregate_type",
            "event_type",
            "rename_all",
            "crate",
            "aggregate_id",
        ];
        assert_eq!(nearest("agregate_id", &keys), Some("aggregate_id"));
        assert_eq!(nearest("aggregate_typ", &keys), Some("aggregate_type"));
        assert_eq!(nearest("eventtype", &keys), Some("event_type"));
        assert_eq!(nearest("evnet_type", &keys), Some("event_type"));
        assert_eq!(nearest("serialize", &keys), None);
        assert_eq!(nearest("", &keys), None);
    }

    #[test]
    fn suggests_rename_rules() {
        let rules: Vec<&str> = crate::case::RULES.iter().map(|(s, _)| *s).collect();
        assert_eq!(nearest("kebab", &rules), Some("kebab-case"));
        assert_eq!(nearest("Kebab-Case", &rules), Some("kebab-case"));
        assert_eq!(nearest("snakecase", &rules), Some("snake_case"));
        assert_eq!(
            nearest("SCREAMING-SNAKE-CASE", &rules),
            Some("SCREAMING_SNAKE_CASE")
        );
        assert_eq!(nearest("title case", &rules), None);
    }
}

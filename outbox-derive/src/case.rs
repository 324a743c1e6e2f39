//! `rename_all` rules: how a default event type is made from a struct or variant name.
//!
//! The rules and their spelling are serde's, applied the way serde applies them to variant
//! names (the names are taken to be `PascalCase`), so `rename_all` means the same in
//! `#[serde(...)]` and `#[outbox(...)]`.

/// A case convention for default event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RenameRule {
    /// `OrderPlaced` → `orderplaced`
    Lower,
    /// `OrderPlaced` → `ORDERPLACED`
    Upper,
    /// `OrderPlaced` → `OrderPlaced`
    Pascal,
    /// `OrderPlaced` → `orderPlaced`
    Camel,
    /// `OrderPlaced` → `order_placed` (the default)
    Snake,
    /// `OrderPlaced` → `ORDER_PLACED`
    ScreamingSnake,
    /// `OrderPlaced` → `order-placed`
    Kebab,
    /// `OrderPlaced` → `ORDER-PLACED`
    ScreamingKebab,
}

/// Every rule with its spelling in `rename_all = "..."`.
pub(crate) const RULES: &[(&str, RenameRule)] = &[
    ("lowercase", RenameRule::Lower),
    ("UPPERCASE", RenameRule::Upper),
    ("PascalCase", RenameRule::Pascal),
    ("camelCase", RenameRule::Camel),
    ("snake_case", RenameRule::Snake),
    ("SCREAMING_SNAKE_CASE", RenameRule::ScreamingSnake),
    ("kebab-case", RenameRule::Kebab),
    ("SCREAMING-KEBAB-CASE", RenameRule::ScreamingKebab),
];

impl RenameRule {
    /// The rule spelled `name`, if any.
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        RULES
            .iter()
            .find(|(spelling, _)| *spelling == name)
            .map(|&(_, rule)| rule)
    }

    /// Applies the rule to a `PascalCase` name.
    pub(crate) fn apply(self, name: &str) -> String {
        match self {
            RenameRule::Pascal => name.to_owned(),
            RenameRule::Lower => name.to_ascii_lowercase(),
            RenameRule::Upper => name.to_ascii_uppercase(),
            RenameRule::Camel => {
                let mut chars = name.chars();
                match chars.next() {
                    Some(first) => first.to_ascii_lowercase().to_string() + chars.as_str(),
                    None => String::new(),
                }
            }
            RenameRule::Snake => {
                let mut snake = String::with_capacity(name.len() + 4);
                for (i, ch) in name.char_indices() {
                    if i > 0 && ch.is_uppercase() {
                        snake.push('_');
                    }
                    snake.push(ch.to_ascii_lowercase());
                }
                snake
            }
            RenameRule::ScreamingSnake => RenameRule::Snake.apply(name).to_ascii_uppercase(),
            RenameRule::Kebab => RenameRule::Snake.apply(name).replace('_', "-"),
            RenameRule::ScreamingKebab => RenameRule::ScreamingSnake.apply(name).replace('_', "-"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RenameRule::*;

    #[test]
    fn rules_match_serde_on_variant_names() {
        let cases = [
            (
                "OrderPlaced",
                [
                    "orderplaced",
                    "ORDERPLACED",
                    "OrderPlaced",
                    "orderPlaced",
                    "order_placed",
                    "ORDER_PLACED",
                    "order-placed",
                    "ORDER-PLACED",
                ],
            ),
            (
                "Placed",
                [
                    "placed", "PLACED", "Placed", "placed", "placed", "PLACED", "placed", "PLACED",
                ],
            ),
            (
                "V2Shipped",
                [
                    "v2shipped",
                    "V2SHIPPED",
                    "V2Shipped",
                    "v2Shipped",
                    "v2_shipped",
                    "V2_SHIPPED",
                    "v2-shipped",
                    "V2-SHIPPED",
                ],
            ),
        ];
        let rules = [
            Lower,
            Upper,
            Pascal,
            Camel,
            Snake,
            ScreamingSnake,
            Kebab,
            ScreamingKebab,
        ];
        for (name, expected) in cases {
            for (rule, expected) in rules.iter().zip(expected) {
                assert_eq!(rule.apply(name), expected, "{rule:?} on {name}");
            }
        }
    }

    #[test]
    fn every_rule_round_trips_its_spelling() {
        for &(spelling, rule) in super::RULES {
            assert_eq!(super::RenameRule::from_name(spelling), Some(rule));
        }
        assert_eq!(super::RenameRule::from_name("kebab"), None);
    }
}

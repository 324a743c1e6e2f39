//! `rename_all` rules: how a default event type is made from a struct or variant name.
//!
//! The rules and their spelling are serde's, applied the way serde applies them to variant
//! names (the names are taken to be `PascalCase`), so `rename_all` means the same in
//! `#[serde(...)]` and `#[outbox(...)]`.

/// A case convention for default event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RenameRule {
    /// `OrderPlaced` → `orderplaced`
    LowerCase,
    /// `OrderPlaced` → `ORDERPLACED`
    UpperCase,
    /// `OrderPlaced` → `OrderPlaced`
    PascalCase,
    /// `OrderPlaced` → `orderPlaced`
    CamelCase,
    /// `OrderPlaced` → `order_placed` (the default)
    SnakeCase,
    /// `OrderPlaced` → `ORDER_PLACED`
    ScreamingSnakeCase,
    /// `OrderPlaced` → `order-placed`
    KebabCase,
    /// `OrderPlaced` → `ORDER-PLACED`
    ScreamingKebabCase,
}

/// Every rule with its spelling in `rename_all = "..."`.
pub(crate) const RULES: &[(&str, RenameRule)] = &[
    ("lowercase", RenameRule::LowerCase),
    ("UPPERCASE", RenameRule::UpperCase),
    ("PascalCase", RenameRule::PascalCase),
    ("camelCase", RenameRule::CamelCase),
    ("snake_case", RenameRule::SnakeCase),
    ("SCREAMING_SNAKE_CASE", RenameRule::ScreamingSnakeCase),
    ("kebab-case", RenameRule::KebabCase),
    ("SCREAMING-KEBAB-CASE", RenameRule::ScreamingKebabCase),
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
            RenameRule::PascalCase => name.to_owned(),
            RenameRule::LowerCase => name.to_ascii_lowercase(),
            RenameRule::UpperCase => name.to_ascii_uppercase(),
            RenameRule::CamelCase => {
                let mut chars = name.chars();
                match chars.next() {
                    Some(first) => first.to_ascii_lowercase().to_string() + chars.as_str(),
                    None => String::new(),
                }
            }
            RenameRule::SnakeCase => {
                let mut snake = String::with_capacity(name.len() + 4);
                for (i, ch) in name.char_indices() {
                    if i > 0 && ch.is_uppercase() {
                        snake.push('_');
                    }
                    snake.push(ch.to_ascii_lowercase());
                }
                snake
            }
            RenameRule::ScreamingSnakeCase => RenameRule::SnakeCase.apply(name).to_ascii_uppercase(),
            RenameRule::KebabCase => RenameRule::SnakeCase.apply(name).replace('_', "-"),
            RenameRule::ScreamingKebabCase => {
                RenameRule::ScreamingSnakeCase.apply(name).replace('_', "-")
            }
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
            LowerCase,
            UpperCase,
            PascalCase,
            CamelCase,
            SnakeCase,
            ScreamingSnakeCase,
            KebabCase,
            ScreamingKebabCase,
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

//! Words that came from outside (an image, a registry, a helper) made safe to print on one line.
use std::borrow::Cow;

/// A line break or an escape sequence is written as its escape (`\n`, `\u{1b}`), never acted on
/// by the terminal, so what was sent stays readable and stays on one line.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return text.into();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// Control characters (a newline, a carriage return that would overwrite the line before it)
/// become spaces, for prose such as a registry's error message.
pub fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect::<String>()
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_words_stay_on_one_line() {
        assert_eq!(printable("plain"), "plain");
        assert_eq!(printable("a\nb\u{1b}[2J"), "a\\nb\\u{1b}[2J");
        assert_eq!(one_line(" a\r\nb "), "a  b");
    }
}

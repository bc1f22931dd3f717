"""Console themes: dark, light and a colour-blind-safe one built on the Okabe–Ito palette.

The console never relies on colour alone (every state has a symbol and a word), and with
NO_COLOR set it sends no colour at all (app/ui/app.py); these themes only choose the hues.
"""

from textual.theme import Theme

# Okabe & Ito (2008), distinguishable with every common form of colour blindness.
OKABE_ITO = {
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
}

HYDRA_DARK = Theme(
    name="hydra-dark",
    primary="#4FA3D9",
    secondary="#7E9CB8",
    accent="#E0A040",
    success="#4CB86A",
    warning="#E0B040",
    error="#E05252",
    foreground="#D8DEE4",
    background="#12161C",
    surface="#1A2028",
    panel="#232B36",
    dark=True,
)

HYDRA_LIGHT = Theme(
    name="hydra-light",
    primary="#1F6FB2",
    secondary="#4E6A85",
    accent="#B06A00",
    success="#1E7D3A",
    warning="#9A6700",
    error="#B42318",
    foreground="#1C2430",
    background="#F7F8FA",
    surface="#FFFFFF",
    panel="#E6EAF0",
    dark=False,
)

HYDRA_COLOURBLIND = Theme(
    name="hydra-colourblind",
    primary=OKABE_ITO["sky_blue"],
    secondary=OKABE_ITO["blue"],
    accent=OKABE_ITO["orange"],
    success=OKABE_ITO["bluish_green"],
    warning=OKABE_ITO["yellow"],
    error=OKABE_ITO["vermillion"],
    foreground="#E8E8E8",
    background="#111111",
    surface="#1B1B1B",
    panel="#262626",
    dark=True,
)

THEMES = {t.name: t for t in (HYDRA_DARK, HYDRA_LIGHT, HYDRA_COLOURBLIND)}
THEME_ALIASES = {
    "dark": "hydra-dark",
    "light": "hydra-light",
    "colourblind": "hydra-colourblind",
    "colorblind": "hydra-colourblind",
    "okabe-ito": "hydra-colourblind",
}

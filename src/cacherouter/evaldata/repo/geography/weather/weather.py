"""Current weather for a city, from a fixed offline table."""

import argparse
import json
import sys

TABLE = {
    "beijing": (31.5, 48, 19.1),
    "shanghai": (29.4, 71, 23.6),
    "guangzhou": (33.0, 65, 25.7),
    "shenzhen": (32.1, 70, 25.9),
    "chengdu": (27.3, 75, 22.4),
    "wuhan": (30.2, 68, 23.7),
}
UNITS = ["c", "f"]

parser = argparse.ArgumentParser(description="Current weather (temperature, humidity, dew point) for a city.")
parser.add_argument("city", help="city name, e.g. Beijing")
parser.add_argument("--units", choices=UNITS, default="c", help="temperature units")
parser.add_argument("--details", action="store_true", help="include humidity and dew point")
args = parser.parse_args()
row = TABLE.get(args.city.lower())
if row is None:
    sys.exit(f"error: no weather data for {args.city!r} (unknown city)")
temp, humidity, dew = row
if args.units == "f":
    temp, dew = round(temp * 9 / 5 + 32, 1), round(dew * 9 / 5 + 32, 1)
out = {"city": args.city, "temperature": temp, "units": args.units}
if args.details:
    out.update(humidity=humidity, dew_point=dew)
print(json.dumps(out))
